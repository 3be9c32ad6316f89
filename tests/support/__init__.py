"""Shared test helpers: model fixtures, a served process, HAProxy, a Vulkan device."""
