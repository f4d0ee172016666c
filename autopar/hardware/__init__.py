"""Hardware profiles: the figures the cost model prices a plan with.

``PROFILES`` holds the built-in ones (``autopar.hardware.profiles``: a100, h100, h200 and the
calibrated cpu); ``load_profile`` reads one a calibration wrote (``autopar.hardware.io``); the
measured curves and their sources are in ``autopar.hardware.gpus``.
"""

from autopar.hardware.curve import Curve
from autopar.hardware.io import load_profile, profile_to_json, save_profile
from autopar.hardware.profile import (GB, TFLOPS, AllocatorMargin, AttentionCurve, BusBandwidth, GiB,
                                      HardwareProfile)
from autopar.hardware.profiles import PROFILES, get_profile

__all__ = ["AllocatorMargin", "AttentionCurve", "BusBandwidth", "Curve", "GB", "GiB", "HardwareProfile",
           "PROFILES", "TFLOPS", "get_profile", "load_profile", "profile_to_json", "save_profile"]
