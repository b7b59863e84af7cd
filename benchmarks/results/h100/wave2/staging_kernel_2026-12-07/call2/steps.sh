# test_spec_gpu's graphs on/off test on main (_ab_base) and the tree, twice each.
T="python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_spec_gpu.py -k graphs_on_off"
step spec_base_1 150 _ab_base $T
step spec_cand_1 150 . $T
