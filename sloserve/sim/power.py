"""GPU power as a function of the SM clock and of what a step keeps busy: what turns the
roofline's seconds into joules, and what an energy-aware clock policy trades against SLO slack.

The model, per GPU, while a step runs at clock fraction s (SM clock / maximum):

    P = idle + active * s^g + memory * u_mem + compute * s^g * u_sm

- `idle`: board power with nothing running (clocks parked); drawn between steps too.
- `active * s^g`: what a GPU draws at clock s whenever a kernel runs, even when its SMs mostly
  wait on memory (clock tree, leakage at the clock's voltage). This is why decode, which is
  memory-bound, still saves energy at a lower clock (Ma et al. 2026, below).
- `memory * u_mem`: HBM traffic; the memory clock is separate from the SM clock, so a lower SM
  clock neither slows nor cheapens it.
- `compute * s^g * u_sm`: the SMs' dynamic power, ~ f * V^2 with voltage falling with the
  clock in the DVFS range, hence s^g with g between 2 and 3. Compute-bound work takes 1/s as
  long, so its energy goes as s^(g-1): lower clocks cost less per FLOP but longer steps pay
  more idle and active power, so the energy per step is U-shaped in the clock.
Each roofline phase (linear layers, attention) has its own u_sm = compute time / phase time and
u_mem = memory time / phase time; all-reduces and launch overhead draw idle + active. Power is
capped at the TDP, as the board's limiter does.

Calibration (H100/H200 SXM, 700 W): a fully compute-bound phase at the top clock reads
idle + active + compute + ~0.3 memory ~ 689 W, about the TDP (H100/H200 datasheets: 700 W);
a memory-bound decode phase (u_mem 1, u_sm ~0.15) ~ 303 W, the top of the 137-300 W range
Ma et al. measured for decode on an H200 ("The Illusion of Power Capping in LLM Decode",
arXiv 2605.11999, 2026), and locking the SM clock at 60% takes ~32% off such a step's energy
(203 W) at no loss of speed, the "up to 32% of decode energy" they recover by clock locking. Idle 65 W:
the idle reading in NVIDIA's DGX B200 Redfish example (64.4 W at a 700 W set point) and what an
idle H100 SXM shows in nvidia-smi. g = 2.5 is an assumption inside the physical 2-3 range;
GreenLLM (arXiv 2508.16449) and Voltana fit the same U-shaped energy-frequency curve. Other
GPUs are the same shares of their own TDP (datasheets), which is an assumption, not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from sloserve.sim.cost import StepWork


@dataclass(frozen=True)
class GpuPower:
    name: str
    tdp_w: float
    idle_w: float
    active_w: float
    memory_w: float
    compute_w: float
    max_clock_mhz: float
    exponent: float = 2.5
    min_clock: float = 0.5  # the lowest SM clock a policy may lock, as a fraction of the maximum
    clock_levels: int = 11  # evenly spaced lockable clocks from min_clock to 1.0

    def clocks(self) -> list[float]:
        """The clock fractions a policy chooses from, highest first."""
        n = self.clock_levels
        if n < 2:
            return [1.0]
        return [1.0 - i * (1.0 - self.min_clock) / (n - 1) for i in range(n)]

    def step_energy(self, work: StepWork, clock: float, seconds: float) -> float:
        """Joules one GPU spends on a step of `work` at `clock` that takes `seconds` in all
        (KV copies and saves included: drawn at idle + active)."""
        scale = clock ** self.exponent
        awake = self.idle_w + self.active_w * scale
        joules, phase_s = 0.0, 0.0
        for compute_s, memory_s in work.phases:
            stretched = compute_s / clock
            t = stretched if stretched > memory_s else memory_s
            if t <= 0.0:
                continue
            e = awake * t + self.memory_w * memory_s + self.compute_w * scale * stretched
            joules += e if e <= self.tdp_w * t else self.tdp_w * t
            phase_s += t
        return joules + awake * max(0.0, seconds - phase_s)

    def mhz(self, clock: float) -> float:
        return clock * self.max_clock_mhz


def _shares(name: str, tdp_w: float, max_clock_mhz: float) -> GpuPower:
    """A GPU calibrated as the H100 SXM: the same shares of its own TDP."""
    return GpuPower(name, tdp_w, tdp_w * 65 / 700, tdp_w * 80 / 700, tdp_w * 80 / 700, tdp_w * 520 / 700,
                    max_clock_mhz)


POWER: dict[str, GpuPower] = {
    # H100 SXM5: 700 W TDP, 1,980 MHz maximum boost clock (datasheet); the calibrated one.
    "h100-80g": GpuPower("h100-80g", 700.0, 65.0, 80.0, 80.0, 520.0, 1980.0),
    # H200 SXM: 700 W, 1,980 MHz (datasheet); Ma et al.'s decode measurements are on this part.
    "h200": GpuPower("h200", 700.0, 65.0, 80.0, 80.0, 520.0, 1980.0),
    # A100 SXM4 80GB: 400 W, 1,410 MHz boost (datasheet).
    "a100-80g": _shares("a100-80g", 400.0, 1410.0),
    # L40S: 350 W, 2,520 MHz boost (datasheet).
    "l40s": _shares("l40s", 350.0, 2520.0),
    # A10: 150 W, 1,695 MHz boost (datasheet).
    "a10-24g": _shares("a10-24g", 150.0, 1695.0),
}


def get_power(hardware: str) -> GpuPower:
    try:
        return POWER[hardware.lower()]
    except KeyError:
        raise ValueError(f"no power model for hardware {hardware!r}; energy is modelled for {sorted(POWER)}") from None
