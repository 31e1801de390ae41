"""Names and limits of the resident-cache compressors, importable without torch."""

COMPRESSOR_NAMES = ("identity", "kakeya_d4", "kakeya_e8")
MAX_Q_RANGE = 1000  # above ~1024 fp16 rounding of qmax can push a coordinate past Q + 0.5
