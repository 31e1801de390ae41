import pathlib
import sys

# --import-mode=importlib does not put a test's folder on sys.path; the proposer factories live here.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
