"""Device discovery (trioshed.devices): Vulkan and RPC servers."""
