"""tools.roofline: kernel times from a trace joined with the optimized HLO's bytes and FLOPs."""

import gzip
import json

import pytest

from tools import roofline as R

HLO = """HloModule jit_step, is_scheduled=true

%fused_add (param_0.1: bf16[1000,512], param_1.2: bf16[512]) -> bf16[1000,512] {
  %param_0.1 = bf16[1000,512]{1,0} parameter(0)
  %param_1.2 = bf16[512]{0} parameter(1)
  %broadcast.3 = bf16[1000,512]{1,0} broadcast(%param_1.2), dimensions={1}
  ROOT %add.4 = bf16[1000,512]{1,0} add(%param_0.1, %broadcast.3)
}

%fused_dot (param_0.5: bf16[64,256], param_1.6: bf16[256,128]) -> f32[64,128] {
  %param_0.5 = bf16[64,256]{1,0} parameter(0)
  %param_1.6 = bf16[256,128]{1,0} parameter(1)
  ROOT %dot.7 = f32[64,128]{1,0} dot(%param_0.5, %param_1.6), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (Arg_0.1: bf16[1000,256], Arg_1.2: bf16[256,512], Arg_2.3: bf16[512]) -> bf16[1000,512] {
  %Arg_0.1 = bf16[1000,256]{1,0} parameter(0)
  %Arg_1.2 = bf16[256,512]{1,0} parameter(1)
  %Arg_2.3 = bf16[512]{0} parameter(2)
  %custom-call.1 = (bf16[1000,512]{1,0}, s8[1024]{0}) custom-call(%Arg_0.1, %Arg_1.2), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %loop_add_fusion.2 = bf16[1000,512]{1,0} fusion(%custom-call.1#0, %Arg_2.3), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/add" stack_frame_id=2}
  %gemm_fusion_dot.3 = f32[64,128]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kCustom, calls=%fused_dot
  ROOT %copy.4 = bf16[1000,512]{1,0} copy(%loop_add_fusion.2)
}

FileNames
1 "/src/gemjax/layers/mlp.py"
2 "/src/gemjax/train/step.py"

FunctionNames
1 "MLP.__call__"
2 "train_step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=7 end_line=7 column=1 end_column=9}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=1}
"""


def _trace(tmp_path, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return str(path)


def test_rows_join_trace_and_hlo(tmp_path):
    ev = lambda name, dur, pid=1: {"ph": "X", "name": name, "pid": pid, "ts": 0, "dur": dur}
    path = _trace(tmp_path, [ev("loop_add_fusion_2", 1000.0), ev("loop_add_fusion_2", 1000.0),
                             ev("nvjet_sm90_tst_128x160", 3000.0), ev("gemm_fusion_dot_3", 40.0),
                             ev("block_attention_fwd", 500.0), ev("loop_add_fusion_2", 9e6, pid=2)])
    mod = R.parse_hlo(HLO)
    table = {r["name"]: r for r in R.rows(R.kernel_times(R.load_events(path), steps=2), mod,
                                           hbm=1e12, matmul=1e14)}
    add = table["loop_add_fusion_2"]           # the host event (pid 2) is not a device kernel
    assert add["calls"] == 1.0 and add["ms"] == pytest.approx(1.0)
    by_hand = 2 * (1000 * 512 * 2) + 512 * 2  # two bf16 [1000, 512] + the bf16 [512] bias
    assert add["bytes"] == by_hand
    assert add["roofline_ms"] == pytest.approx(by_hand / 1e12 * 1e3)
    assert add["ratio"] == pytest.approx(1.0 / (by_hand / 1e9))
    assert add["source"] == "layers/mlp.py:42 MLP.__call__"
    gemm = table["cuBLAS GEMMs"]               # the unnamed cuBLAS kernel against the custom call
    assert gemm["flops"] == 2 * 1000 * 512 * 256 and gemm["ms"] == pytest.approx(1.5)
    assert gemm["roofline_ms"] == pytest.approx(2 * 1000 * 512 * 256 / 1e14 * 1e3)
    tri = table["gemm_fusion_dot_3"]           # a Triton GEMM fusion: its dot's FLOPs count
    assert tri["flops"] == 2 * 64 * 128 * 256
    assert tri["roofline_ms"] == pytest.approx(max(tri["bytes"] / 1e12, tri["flops"] / 1e14) * 1e3
                                               * 0.5)
    assert table["block_attention_fwd"]["roofline_ms"] is None      # not in the HLO
    assert list(table)[0] == "cuBLAS GEMMs"                          # sorted by time
    text = R.format_rows(list(table.values()))
    assert "loop_add_fusion_2" in text and "ms of device kernels per step" in text
    want = sum(min(r["ms"], r["roofline_ms"]) if r["roofline_ms"] else r["ms"]
               for r in table.values())
    assert R.at_roofline(list(table.values())) == pytest.approx(want)
    assert want < sum(r["ms"] for r in table.values())


def test_shape_bytes_and_tuples():
    assert R.shape_bytes("(bf16[2,3]{1,0}, s8[10]{0}, pred[4])") == 12 + 10 + 4
    assert R._elements("(f32[2]{0}, (s32[3], u8[1]))") == ["f32[2]{0}", "(s32[3], u8[1])"]
    mod = R.parse_hlo(HLO)
    assert R.operand_shape("%custom-call.1#1", mod) == "s8[1024]{0}"


def test_main_rejects_a_file_without_hlo(tmp_path, capsys):
    path = _trace(tmp_path, [])
    bad = tmp_path / "x.txt"
    bad.write_text("not hlo\n")
    with pytest.raises(SystemExit):
        R.main([path, str(bad)])
    assert "no HLO instructions" in capsys.readouterr().err
