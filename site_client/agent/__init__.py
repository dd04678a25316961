"""The site agent: its state, the trainer channel, the WAN worker, multi-node parts."""
