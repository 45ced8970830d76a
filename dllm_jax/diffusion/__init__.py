"""Diffusion training: noise schedules, corruption (forward process) and objectives."""

from dllm_jax.diffusion.corruption import d2f_block_ratios, d2f_corrupt, sample_times
from dllm_jax.diffusion.objectives import (OBJECTIVES, ar_loss, block_diffusion_loss, d2f_loss,
                                           make_objective, mdm_loss)
from dllm_jax.diffusion.schedules import SCHEDULES, Schedule, get_schedule
