"""``import ferrox_driver`` stays light: ml_dtypes (most of a second) and torch are imported
only when a bf16/fp8 dtype or a tensor is met (issue 45). Fresh processes: this one has
them loaded already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrox_driver.driver.dtypes import DTypes, DTypeTable, named

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_ferrox_driver_imports_neither_ml_dtypes_nor_torch() -> None:
    got = _run(
        "import sys, json\n"
        "import ferrox_driver\n"
        "heavy = ('ml_dtypes', 'torch', 'transformers', 'nccl')\n"
        "print(json.dumps({m: m in sys.modules for m in heavy}))\n"
    )
    assert got == {"ml_dtypes": False, "torch": False, "transformers": False, "nccl": False}


def test_float32_and_float16_work_without_importing_ml_dtypes() -> None:
    got = _run(
        "import sys, json\n"
        "import numpy as np\n"
        "import ferrox_driver as fd\n"
        "from ferrox_driver.decode.checks import SUPPORTED_DTYPES, dtype_name, check_dtype\n"
        "from ferrox_driver.decode.fp8 import FP8_DTYPES, ROW_DTYPES\n"
        "q = np.ones((4, 8), np.float16); k = np.ones((3, 2, 8), np.float16)\n"
        "out = fd.reference_gqa_decode(q, k, k, n_heads=4, n_kv_heads=2, head_dim=8)\n"
        "print(json.dumps({\n"
        "  'names': [dtype_name(np.float32), dtype_name(np.float16)],\n"
        "  'f16': str(check_dtype('f16', 'dtype')),\n"
        "  'in': [np.dtype(np.float32) in SUPPORTED_DTYPES, np.dtype('>f4') in SUPPORTED_DTYPES,\n"
        "         np.dtype(np.float16) in ROW_DTYPES, np.dtype(np.int8) in ROW_DTYPES],\n"
        "  'fp8': FP8_DTYPES.get(np.dtype(np.float32), ''),\n"
        "  'ref': float(out.sum()),\n"
        "  'ml_dtypes': 'ml_dtypes' in sys.modules,\n"
        "  # a name numpy learns from ml_dtypes: imported for it, then understood\n"
        "  'fnuz': str(fd.driver.memory.as_dtype('float8_e4m3fnuz', 'dtype'))}))\n"
    )
    assert got["names"] == ["f32", "f16"] and got["f16"] == "float16"
    assert got["in"] == [True, False, True, False]
    assert got["fp8"] == "" and got["ref"] == pytest.approx(32.0)
    assert got["ml_dtypes"] is False and got["fnuz"] == "float8_e4m3fnuz"


def test_bf16_and_fp8_by_name_import_ml_dtypes_on_first_use() -> None:
    got = _run(
        "import sys, json\n"
        "import numpy as np\n"
        "from ferrox_driver.driver.memory import as_dtype\n"
        "from ferrox_driver.decode.checks import SUPPORTED_DTYPES, dtype_name\n"
        "from ferrox_driver.decode.fp8 import FP8_DTYPES, ROW_DTYPES, fp8_max\n"
        "before = 'ml_dtypes' in sys.modules\n"
        "bf16, e4m3 = as_dtype('bf16', 'dtype'), as_dtype('float8_e4m3fn', 'dtype')\n"
        "import ml_dtypes\n"
        "print(json.dumps({'before': before,\n"
        "  'bf16': bf16 == np.dtype(ml_dtypes.bfloat16),\n"
        "  'e4m3': e4m3 == np.dtype(ml_dtypes.float8_e4m3fn),\n"
        "  'e5m2_str': str(as_dtype('float8_e5m2', 'dtype')),\n"
        "  'name': dtype_name(bf16), 'in': bf16 in SUPPORTED_DTYPES and bf16 in ROW_DTYPES,\n"
        "  'fp8': FP8_DTYPES.get(e4m3, ''), 'max': fp8_max(e4m3)}))\n"
    )
    assert got == {
        "before": False,
        "bf16": True,
        "e4m3": True,
        "e5m2_str": "float8_e5m2",
        "name": "bf16",
        "in": True,
        "fp8": "e4m3",
        "max": 448.0,
    }


def test_a_bf16_array_made_by_the_caller_is_recognised() -> None:
    # The caller imported ml_dtypes after ferrox (the tables were built without it).
    got = _run(
        "import json\n"
        "import numpy as np\n"
        "import ferrox_driver as fd\n"
        "import ml_dtypes\n"
        "rng = np.random.default_rng(0)\n"
        "q = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)\n"
        "k = rng.standard_normal((5, 2, 8)).astype(ml_dtypes.bfloat16)\n"
        "out = fd.reference_gqa_decode(q, k, k, n_heads=4, n_kv_heads=2, head_dim=8)\n"
        "from ferrox_driver.decode.checks import dtype_name\n"
        "print(json.dumps({'shape': list(out.shape), 'name': dtype_name(q.dtype)}))\n"
    )
    assert got == {"shape": [4, 8], "name": "bf16"}


def test_dtype_table_looks_up_by_dtype_and_refuses_other_byte_orders() -> None:
    import ml_dtypes

    table = DTypeTable({"float32": "f32", "bfloat16": "bf16"})
    assert table[np.dtype(np.float32)] == "f32"
    assert table[np.dtype(ml_dtypes.bfloat16)] == "bf16"
    assert np.dtype(">f4") not in table and np.dtype(np.float16) not in table
    assert table.get(np.dtype(np.int8), "") == ""
    assert dict(table.items()) == {
        np.dtype(np.float32): "f32",
        np.dtype(ml_dtypes.bfloat16): "bf16",
    }
    assert len(table) == 2


def test_dtypes_index_slice_and_contain_like_a_tuple() -> None:
    import ml_dtypes

    rows = DTypes("float32", "float16", "bfloat16")
    assert tuple(rows) == (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    assert rows[2] == np.dtype(ml_dtypes.bfloat16) and len(rows) == 3
    assert tuple(rows[1:]) == (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    assert np.dtype(np.float32) not in rows[1:] and np.dtype(">f2") not in rows
    assert named("float8_e5m2") == np.dtype(ml_dtypes.float8_e5m2)


def test_dlpack_type_codes_of_ml_dtypes_both_ways() -> None:
    import ml_dtypes

    from ferrox_driver.driver import dlpack

    assert dlpack._CODES[np.dtype(ml_dtypes.bfloat16)] == (4, 16)
    assert dlpack._CODES[np.dtype(ml_dtypes.float8_e4m3fn)] == (10, 8)
    assert dlpack._dtype_of((4, 16, 1)) == np.dtype(ml_dtypes.bfloat16)
    assert dlpack._dtype_of((12, 8, 1)) == np.dtype(ml_dtypes.float8_e5m2)
    assert dlpack._dtype_of((2, 32, 1)) == np.dtype(np.float32)
    assert dlpack._dtype_of((4, 16, 2)) is None and dlpack._dtype_of((9, 8, 1)) is None
