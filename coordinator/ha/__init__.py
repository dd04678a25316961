"""Standby coordinators: the election (pure rules), its etcd I/O, the standby front."""
