"""bench/step_parts.py on a tiny Q4_1 GGUF file, in this process: the engine's clock and the profiler's parts are
measured, the forward's native matmuls and paged loop are found in its HLO, and the record has no file path."""

import dataclasses
import json

import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from bench import step_parts  # noqa: E402
from tests.gguf.test_gguf import SPECS, write_gguf  # noqa: E402


def test_the_parts_of_a_step_are_measured_and_named(tmp_path):
    path = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(path, dataclasses.replace(SPECS["llama"], layers=1), Q.Q4_1)
    out = tmp_path / "results" / "step_parts"
    assert step_parts.main(["--gguf", str(path), "--rows", "4", "--context", "20", "--steps", "2",
                            "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert set(record["cpu_ms"]) == set(step_parts.PARTS) and sum(record["cpu_ms"].values()) > 0
    assert record["cpu_ms"]["sampling"] > 0 and record["cpu_ms"]["head"] + record["cpu_ms"]["products"] > 0
    assert record["engine"]["step_ms"] > 0 and record["engine"]["host_ms"] > 0
    assert "/path/to/gguf" in record["command"] and "| head |" in out.with_suffix(".md").read_text()


def test_the_forward_s_native_calls_are_sorted_by_their_target_and_width():
    hlo = "\n".join([
        '  %ffi_call.3 = f32[32,49152]{1,0} custom-call(f32[32,576]{1,0} %x), custom_call_target="jaxattn_quant_matmul_int8_panels"',
        '  %ffi_call.4 = f32[32,1536]{1,0} custom-call(f32[32,576]{1,0} %x), custom_call_target="jaxattn_quant_matmul_int4"',
        '  %ffi_call.5 = f32[32,9,64]{2,1,0} custom-call(f32[32,9,64]{2,1,0} %q), custom_call_target="jaxattn_paged_attention"',
        '  ROOT %dot.7 = f32[4,4]{1,0} dot(f32[4,8]{1,0} %a, f32[8,4]{1,0} %b)',
        '  %add.1 = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %b)'])
    assert step_parts.forward_parts(hlo, 49152) == {"ffi_call.3": "head", "ffi_call.4": "products",
                                                    "ffi_call.5": "attention", "dot.7": "products"}
