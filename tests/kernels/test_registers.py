"""The setmaxnreg counts of the warp-specialized Mosaic kernels fit the registers a
program is launched with (`mosaic_tiles.registers_fit`). An increase past them does not
fail to compile: the warpgroup waits for registers nobody releases and the GPU hangs."""

import pytest

from pallas_flex.kernels import (
    backward_mosaic, decode_latent_mosaic, decode_latent_stage_mosaic, forward_mosaic)
from pallas_flex.kernels.mosaic_tiles import registers_fit


def test_the_rule_itself():
    assert registers_fit((232, 232, 40))      # 504 = 3 x 168
    assert not registers_fit((240, 232, 40))  # 512: the increase waits forever
    assert registers_fit((240, 24))           # two warpgroups: 2 x 256
    assert not registers_fit((236, 24))       # not a multiple of 8
    assert not registers_fit((16, 24))        # below setmaxnreg's 24


@pytest.mark.parametrize("counts", [
    forward_mosaic._REGISTERS[:1] * forward_mosaic.COMPUTE_WARPGROUPS
    + forward_mosaic._REGISTERS[1:],
    backward_mosaic._REGISTERS[:1] * backward_mosaic.COMPUTE_WARPGROUPS
    + backward_mosaic._REGISTERS[1:],
    decode_latent_mosaic._REGISTERS[:1] * decode_latent_mosaic.COMPUTE_WARPGROUPS
    + decode_latent_mosaic._REGISTERS[1:],
    decode_latent_stage_mosaic._REGISTERS,
], ids=["forward", "backward", "latent_decode", "latent_key_stage_decode"])
def test_every_kernel_fits(counts):
    assert registers_fit(counts), counts
