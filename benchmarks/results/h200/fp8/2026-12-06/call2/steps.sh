S=benchmarks/results/h100/wave2/fp8_2026-12-06g/call2/decode_ncu_case.py
step ncu 240 . bash -c 'NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1); $NCU --clock-control none --profile-from-start off -k regex:_decode --set full -o $1/decode python3 $0 && $NCU -i $1/decode.ncu-rep --page details > $1/decode_details.txt' $S $R
step time_pdl 100 . TIME_TOO=1 python3 $S $R
step time_nopdl 100 . TIME_TOO=1 TOKENSPEED_PDL=0 python3 $S $R
step kv_nopdl 120 . TOKENSPEED_PDL=0 python3 benchmarks/fp8_e2e.py --profile --sections kv_long --out $R/kv_nopdl.json
