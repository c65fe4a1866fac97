import subprocess
import sys


def test_package_imports_without_torch():
    code = (
        "import sys, bucketserve.bucket_manager, bucketserve.bucket_manager.cli, "
        "bucketserve.bucket_manager.bucket_manager; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
