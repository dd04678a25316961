"""What the coordinator and the site agents both speak: protocol, tensor payloads, retries."""
