"""The published training runs ``benchmarks/fidelity.py`` prices, each pinned as published.

torchtitan (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, runs of 2024-12 at
torchtitan 9dec370, torch 1963fc8): Grand Teton hosts of 8 H100s "with 96GB HBM2e with 2.4 TB/sec
peak memory bandwidth", 400 Gb/s per GPU across hosts, a 500 W power limit; TPS/GPU read at step
90; memory is ``max_reserved`` (its train.py logs ``torch.cuda`` reserved bytes). Its footnote: the
GPUs' "actual peak TFLOPs number is between SXM and NVL". Table 1: Llama 3.1 8B on 8 GPUs, FSDP,
local batch 2, global 16, selective ("op") checkpointing: 5,762 TPS/GPU at 82.4 GiB eager (6,667
compiled, 8,532 float8). Table 3: the same on 128 GPUs, global 256: 5,605 at 67.0 GiB. Table 4:
70B on 256 GPUs (FSDP 32, TP 8), local batch 16, full checkpointing, compiled with float8: 829 at
71.9 GiB. Table 5: 405B on 512 GPUs (FSDP 8, TP 8, PP 8), local batch 32, global 256, full
checkpointing, compiled, float8 and async TP: 1F1B 100 at 82.5 GiB, interleaved 1F1B 128 at 72.7.
Sequence 8192 (train_configs/llama3_*.toml); FSDP2 keeps the last block's parameters gathered
(``reshard_after_forward=False`` for it: parallelize_llama.py).

Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473), Selene: DGX A100 80GB nodes, 8 HDR
200 Gb/s NICs each. Table 1 (also NVIDIA/Megatron-LM README, images/cases_april2021.png): GPT
models of vocabulary 51200 and sequence 2048, heads as the paper lists them, "model-parallel size"
= tensor 8 x pipeline stages beyond 8, full activation recomputation (REFERENCE.md), measured
TFLOP/s per GPU by the paper's eq. 3 (recomputation counted). Neither the micro-batch size nor the
schedule is published per row: pinned here at micro-batch 1 and 1F1B for pipelined rows (Megatron's
examples/pretrain_gpt3_175B.sh runs micro-batch 1 with the default, non-interleaved schedule), the
whole local batch per step for pipeline-free rows. Table 2: ZeRO-3 (DeepSpeed, no model parallelism,
micro-batch as listed) against PTD parallelism (tensor 8 x pipeline 12 for 175B, 8 x 35 for 530B,
micro-batch 1), 175B at global batch 1536, 530B at 2240 (2560 on 640 GPUs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.hardware import GB, TFLOPS, HardwareProfile, get_profile
from benchmarks import titan_llama
from examples import gpt

H100_SXM_PEAK, H100_NVL_PEAK = 989 * TFLOPS, 835 * TFLOPS
"""Dense bf16 peaks of the H100 SXM5 and the H100 NVL datasheets (NVL: 1,671 TFLOPS with sparsity)."""


def grand_teton(peak: float) -> HardwareProfile:
    """torchtitan's GPUs: H100 silicon (SXM's curves, links and NICs) with 96 GB of HBM2e at
    2.4 TB/s and a compute peak of ``peak``: the midpoint of NVL's and SXM's for the prediction,
    each end for its band (module docstring)."""
    return dataclasses.replace(get_profile("h100"), name=f"h100-grand-teton-{peak / TFLOPS:.0f}",
                               peak_flops_bf16=peak, memory_bandwidth=2400 * GB, memory_bytes=int(96 * GB))


GRAND_TETON_PEAKS = (H100_NVL_PEAK, (H100_NVL_PEAK + H100_SXM_PEAK) / 2, H100_SXM_PEAK)
"""Low end, prediction, high end."""


@dataclass(frozen=True, kw_only=True)
class TitanRun:
    """A torchtitan run: the Llama 3 of ``titan_llama`` planned with the published pins."""

    name: str
    config: titan_llama.TitanConfig
    axes: dict[str, int]
    batch: int
    """Global batch, sequences."""
    measured_tps: float
    """Published tokens/s per GPU."""
    measured_gib: float
    """Published peak reserved memory per GPU, GiB."""
    checkpoint: str
    pipeline: tuple[str, int, int] | None = None
    """(schedule, micro-batches, stages per rank) of the pp axis, or None."""
    float8: bool = False
    """Run with float8 linears (and torch.compile): not comparable with a bf16 eager prediction."""
    eager: bool = True


@dataclass(frozen=True, kw_only=True)
class MegatronRun:
    """A Megatron-LM / DeepSpeed GPT run from arXiv 2104.04473."""

    name: str
    table: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    batch: int
    tp: int
    pp: int
    micro_batch: int
    measured_tflops: float
    zero3: bool = False
    """DeepSpeed ZeRO-3 without model parallelism (Table 2's baseline)."""
    seq: int = 2048
    vocab: int = 51200

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.dp * self.micro_batch)

    def config(self) -> gpt.GPTConfig:
        return gpt.GPTConfig(vocab_size=self.vocab, max_seq_len=self.seq, hidden=self.hidden, heads=self.heads,
                             layers=self.layers)

    def flops(self) -> float:
        """Megatron's eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) per step, recomputation counted."""
        b, s, l, h = self.batch, self.seq, self.layers, self.hidden
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + self.vocab / (16 * l * h))


TITAN = (
    TitanRun(name="titan 8B FSDP 8", config=titan_llama.LLAMA3_8B, axes={"dp": 8}, batch=16, measured_tps=5762,
             measured_gib=82.4, checkpoint="selective_op"),
    TitanRun(name="titan 8B FSDP 128", config=titan_llama.LLAMA3_8B, axes={"dp": 128}, batch=256, measured_tps=5605,
             measured_gib=67.0, checkpoint="selective_op"),
    TitanRun(name="titan 70B FSDP32xTP8", config=titan_llama.LLAMA3_70B, axes={"dp": 32, "tp": 8}, batch=512,
             measured_tps=829, measured_gib=71.9, checkpoint="full", float8=True, eager=False),
    TitanRun(name="titan 405B 3D 1F1B", config=titan_llama.LLAMA3_405B, axes={"pp": 8, "dp": 8, "tp": 8}, batch=256,
             measured_tps=100, measured_gib=82.5, checkpoint="full", pipeline=("1f1b", 8, 1), float8=True,
             eager=False),
    TitanRun(name="titan 405B 3D interleaved", config=titan_llama.LLAMA3_405B, axes={"pp": 8, "dp": 8, "tp": 8},
             batch=256, measured_tps=128, measured_gib=72.7, checkpoint="full", pipeline=("interleaved_1f1b", 8, 2),
             float8=True, eager=False),
)

_T1 = ((1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 30, 3072, 32, 2, 1, 64, 512, 138),
       (7.5, 36, 4096, 32, 4, 1, 128, 512, 142), (18.4, 40, 6144, 48, 8, 1, 256, 1024, 135),
       (39.1, 48, 8192, 64, 8, 2, 512, 1536, 138), (76.1, 60, 10240, 80, 8, 4, 1024, 1792, 140),
       (145.6, 80, 12288, 96, 8, 8, 1536, 2304, 148), (310.1, 96, 16384, 128, 8, 16, 1920, 2160, 155),
       (529.6, 105, 20480, 128, 8, 35, 2520, 2520, 163), (1008.0, 128, 25600, 160, 8, 64, 3072, 3072, 163))
"""Table 1: (billions, layers, hidden, heads, tp, pp, GPUs, batch, TFLOP/s per GPU)."""

MEGATRON_T1 = tuple(
    MegatronRun(name=f"megatron T1 {b:g}B", table="1", layers=l, hidden=h, heads=a, gpus=n, batch=batch, tp=tp, pp=pp,
                micro_batch=1 if pp > 1 else batch // (n // tp), measured_tflops=tf)
    for b, l, h, a, tp, pp, n, batch, tf in _T1)

_GPT3 = {"layers": 96, "hidden": 12288, "heads": 96}
_530B = {"layers": 105, "hidden": 20480, "heads": 128}
MEGATRON_T2 = (
    *(MegatronRun(name=f"megatron T2 175B ZeRO-3 {n}", table="2", gpus=n, batch=1536, tp=1, pp=1, micro_batch=b,
                  measured_tflops=tf, zero3=True, **_GPT3)
      for n, b, tf in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))),
    *(MegatronRun(name=f"megatron T2 530B ZeRO-3 {n}", table="2", gpus=n, batch=batch, tp=1, pp=1, micro_batch=b,
                  measured_tflops=tf, zero3=True, **_530B)
      for n, batch, b, tf in ((640, 2560, 4, 138), (1120, 2240, 2, 98), (2240, 2240, 1, 48))),
    *(MegatronRun(name=f"megatron T2 175B PTD-P {n}", table="2", gpus=n, batch=1536, tp=8, pp=12, micro_batch=1,
                  measured_tflops=tf, **_GPT3) for n, tf in ((384, 153), (768, 149), (1536, 141))),
    *(MegatronRun(name=f"megatron T2 530B PTD-P {n}", table="2", gpus=n, batch=2240, tp=8, pp=35, micro_batch=1,
                  measured_tflops=tf, **_530B) for n, tf in ((560, 171), (1120, 167), (2240, 159))),
)

KERNEL_NOTE = ("Megatron's 2021 kernels beside what is priced (benchmarks/megatron_gpt.py): its unfused attention "
               "and tied output layer are modelled, its dropouts are not (a fused pass each over probabilities and "
               "hidden states, unpriced); its fused scale-mask-softmax and bias-GeLU are one pass each where the "
               "model prices two, apex's LayerNorm and fused "
               "Adam are priced as torch's, fp16 with loss scaling as bf16 (the same A100 peak); its GEMMs are "
               "priced at cuBLAS's isolated-GEMM curve, up to 87% of peak (MAMF), which the measured end-to-end "
               "TFLOP/s (44-52% of peak with recomputation counted) suggest they did not sustain")
"""Where the profile's figures and Megatron's kernels differ (printed beside the Megatron rows)."""

TITAN_NOTE = ("pinned with torchtitan's own 'op' selective checkpointing (checkpoint='selective_op': attention and "
              "every other linear matmul of a block kept, parallelize_llama.py at 9dec370); its reserved peak is "
              "above the plan's predicted peak (on 8 GPUs by ~5 GiB): what the run held beyond the live tensors the "
              "plan counts is not in the source")
