"""What every model file composes on top of pagedkv.ops: rotary tables, paged attention."""
