"""The isthmus site side: the agent, its CLI and the API a training script calls."""
