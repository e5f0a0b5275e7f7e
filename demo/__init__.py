"""The tb_gradhealth demo: ``python demo/demo.py --logdir DIR [--serve]`` or ``python -m demo --logdir DIR``."""
