S=benchmarks/results/h100/wave2/moe_ncu/moe_ncu_case.py
step ncu 300 . bash -c 'NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1); echo ncu=$NCU; $NCU --clock-control none --profile-from-start off -k regex:_moe_ --set full -o $1/moe python3 $0 && $NCU -i $1/moe.ncu-rep --page details > $1/moe_details.txt' $S $R
