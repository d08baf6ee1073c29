"""What operators look at: the lanes, workers, cache and usage gathered from Redis (`queues`, for
`mrc queues`)."""
