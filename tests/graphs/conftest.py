"""The CPU stand-in for CUDA graphs (``standin.py``) as a fixture: ``def test_x(stand_in): ...``."""

from graphs.standin import stand_in

__all__ = ["stand_in"]
