"""The API's description: ``GET /openapi.json``, written by hand in parts and kept true to the
routes by the tests."""
