"""Sending checked jobs to Redis and reading them back (every producer surface's): `sender.Queue`;
a resubmission's answer (`resubmission`); dead letters sent back (`dlq`)."""
