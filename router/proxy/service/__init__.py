"""Running a fleet behind the proxy: its config schema, the proxy lifecycle, router replicas
and the store they share."""
