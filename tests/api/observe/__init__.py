"""What observes the API (trioshed.api.observe): metrics, the gateway's protocol, the status page."""
