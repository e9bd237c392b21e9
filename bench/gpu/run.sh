# On the device: bash bench/gpu/run.sh SECONDS "LABEL:SEED ..." -- each run of bench/reproduce.py fedper-paper in its own
# process on the GPU until SECONDS have passed; every results.json (written after each round) goes back in $OUT.
limit=$1; shift
for job in $1; do
  label=${job%:*}; seed=${job#*:}
  timeout $limit python3 -P $R/bench/reproduce.py fedper-paper --only "$label" --seeds $seed --rounds 100 \
    --out /tmp/runs --data-root /tmp/data --device cuda --threads ${THREADS:-4} > $OUT/log-${label//\//-}-$seed.txt 2>&1 &
done
while sleep 30; do
  n=$(jobs -r | wc -l)
  for f in /tmp/runs/fedper-paper/*/*/seed*/results.json; do
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rounds']; print(sys.argv[1][27:], len(r), r[-1]['test_accuracy']['mean'] if r else None, r[-1]['seconds'] if r else None)" $f 2>/dev/null
  done
  (cd /tmp/runs && tar czf $OUT/results.tgz $(find . -name results.json))
  [ "$n" = 0 ] && break
done
wait
ls -la $OUT
