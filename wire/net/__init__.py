"""Connections: channels with mutual TLS, gRPC settings, finding the leader, TLS diagnosis."""
