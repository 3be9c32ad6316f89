"""What observes the API: Prometheus metrics and the inference gateway's protocol on
``/metrics``, the request log, the status page's data and live events, and the page itself."""
