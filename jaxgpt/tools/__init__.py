"""Commands beyond one training run: benchmarks, sweeps, launching many processes.

    bench.py          `jaxgpt bench`: steps, kernels, decoding, data, timed
    bench_startup.py  cold and warm starts in fresh processes
    sweep.py          sweeps: a grid of runs, vmapped where only seeds or optimiser values vary
    sweep_report.py   a sweep's results: table, plot
    launch.py         `jaxgpt launch`: N local processes as one distributed run

May import every package but the command line.
"""
