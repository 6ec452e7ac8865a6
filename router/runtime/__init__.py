"""The `fairway` runtime: the compiled builds of the hot modules, the huge-page arenas a
simulation runs on, and the collector pacing."""
