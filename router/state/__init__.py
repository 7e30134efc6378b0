"""What the router knows about its endpoints: ``pool`` (endpoints, groups, per-slot feature arrays,
reservations), ``features`` (every per-endpoint feature, declared once), ``kv_sink`` (where KV
events land)."""
