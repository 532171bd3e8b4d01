"""Drawing timelines with matplotlib (imported only when a drawing function is first used)."""

__all__ = ["draw_timeline", "draw_timelines", "timeline_title"]


def __getattr__(name):
    if name in __all__:
        from twinpipe.viz import draw

        return getattr(draw, name)
    raise AttributeError(f"module 'twinpipe.viz' has no attribute {name!r}")
