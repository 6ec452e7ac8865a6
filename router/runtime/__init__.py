"""The `fairway` runtime: the compiled builds of the hot modules and the collector pacing."""
