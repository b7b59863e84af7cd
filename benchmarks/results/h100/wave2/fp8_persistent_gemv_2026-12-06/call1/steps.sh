step gemv_stack 200 . python3 benchmarks/gemv_stack.py --out $R/gemv_stack.json
step pick 30 . python3 pick_persistent.py $R/gemv_stack.json $R/pick.txt
step main1 110 . python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/main1.json
step pers1 110 . TOKENSPEED_FP8_GEMV_PERSISTENT=$(cat $R/pick.txt) python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/pers1.json
step main2 110 . python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/main2.json
step pers2 110 . TOKENSPEED_FP8_GEMV_PERSISTENT=$(cat $R/pick.txt) python3 benchmarks/fp8_e2e.py --sections llama --profile --out $R/pers2.json
step ncu 150 . PICKS=$(cat $R/pick.txt),$(cat $R/pick.txt.second) ncu --profile-from-start off --clock-control none --set full --import-source no -f -o $R/gemv python3 ncu_gemv.py
step ncu_pages 60 . bash -c "ncu -i $R/gemv.ncu-rep --page details > $R/ncu_details.txt; ncu -i $R/gemv.ncu-rep --page source --csv --print-source sass > $R/ncu_source.csv; ncu -i $R/gemv.ncu-rep --page raw --csv > $R/ncu_raw.csv; ls -la $R"
