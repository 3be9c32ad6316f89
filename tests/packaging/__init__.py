"""What packaging/ ships: the Kubernetes manifests and the balancer's configuration."""
