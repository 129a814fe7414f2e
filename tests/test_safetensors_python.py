#!/usr/bin/python3
"""Our safetensors files against the reference implementation (the `safetensors` Python
package, with numpy), both ways: the package reads what save_safetensors wrote, and
load_safetensors reads what the package wrote. Exits 77 (Meson's SKIP) when the package or
numpy is not installed. Usage: test_safetensors_python.py PATH/TO/safetensors_tool"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file
except ImportError as error:
    print(f"SKIP: {error} (pip install safetensors numpy to run this test)")
    sys.exit(77)

tool = sys.argv[1]
with tempfile.TemporaryDirectory() as folder:
    ours = os.path.join(folder, "ours.safetensors")
    subprocess.run([tool, "write", ours], check=True)
    with safe_open(ours, framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "epochs": "3"}, f.metadata()
        assert sorted(f.keys()) == ["empty", "fc.bias", "fc.weight", "labels"], f.keys()
        weight = f.get_tensor("fc.weight")
        assert weight.dtype == np.float32 and weight.shape == (2, 3)
        expected = np.array([[0.5, -1.25, 3.0], [1e-8, -0.0, 65504.0]], dtype=np.float32)
        assert np.array_equal(weight, expected) and np.signbit(weight[1, 1]), weight
        assert f.get_tensor("fc.bias").tolist() == [-2.5]
        labels = f.get_tensor("labels")
        assert labels.dtype == np.int64 and labels.tolist() == [-1, 0, 1 << 40], labels
        assert f.get_tensor("empty").shape == (0, 2)

    theirs = os.path.join(folder, "theirs.safetensors")
    save_file(
        {
            "b": np.array([1.5, -2.0], dtype=np.float32),
            "a": np.arange(6, dtype=np.int64).reshape(3, 2),
            "c": np.array([7, 255], dtype=np.uint8),
        },
        theirs,
        metadata={"source": "numpy"},
    )
    printed = subprocess.run([tool, "print", theirs], check=True, capture_output=True, text=True).stdout
    expected_lines = [
        "a int64 [3, 2] 0 1 2 3 4 5",
        "b float32 [2] 1.5 -2",
        "c uint8 [2] 7 255",
        "metadata source numpy",
    ]
    assert printed.splitlines() == expected_lines, printed
print("safetensors package and nanoddp read each other's files")
