import sys
from pathlib import Path

# tests/store/s3server.py gives every directory its ``s3`` fixture (a real SeaweedFS per module)
sys.path.insert(0, str(Path(__file__).parent / "store"))

pytest_plugins = ["pytest_jupyter.jupyter_server", "s3server"]
