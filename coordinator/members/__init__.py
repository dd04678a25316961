"""Who is in the job: leases with fencing tokens, suspicion, drains."""
