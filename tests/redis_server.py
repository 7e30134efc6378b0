from loadtests.servers.redis import RedisServer, available  # noqa: F401  (temporary)
