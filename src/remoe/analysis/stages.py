"""Stage detection moved to the neutral :mod:`remoe.stages` (the trainer's summary and
``remoe analyze`` share it without importing each other); this path keeps working."""

from remoe.stages import (Stages, band_excursions, centered_mean, detect_stages,  # noqa: F401
                          mean_std_after, settle_index, trailing_mean)
from remoe.stages import SETTLE_TOL, SETTLE_WINDOW, SMOOTH, STAGE_EPS  # noqa: F401
