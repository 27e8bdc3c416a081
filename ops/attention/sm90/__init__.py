"""The sm_90 (Hopper) warp-specialized kernel of the attention core, in Gluon: see kernel.py."""
