"""Moving payloads over the WAN: the client's calls, fetches and pushes over K streams."""
