"""pytest plugin: kombu's Redis transport module with mrc's Channel and Transport (and their Sentinel
variants) in place of its own,
loaded before kombu's tests import it (they subclass `redis.Channel` at import time)."""

import kombu.transport.redis as stock

import shared.transport as ours

stock.Channel = ours.Channel
stock.Transport = ours.Transport
stock.SentinelChannel = ours.SentinelChannel
stock.SentinelTransport = ours.SentinelTransport
