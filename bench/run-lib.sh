# Shared by bench/gpu-run.sh and bench/ab.sh (sourced): the run's time budget and unpacking.
# budget_from SECONDS_ALLOWED starts the budget; `cap N` is N or what is left of it, whichever is
# less (at least 1), for each step's timeout.
budget_from() { RUN_END=$((SECONDS + $1)); }
cap() { local left=$((RUN_END - SECONDS)); if [ "$left" -lt "$1" ]; then echo $((left > 1 ? left : 1)); else echo "$1"; fi; }
# unpack ARCHIVE DIR: gzip or xz through Python's tarfile (the GPU machine's tar may lack xz)
unpack() { python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"; }
