"""The `fxpar` command line (main.py), one module per command, and the tools only the commands use
(loading TARGET is fxpar/targets.py, which `fxpar check`'s proof shares).

    main.py              the parser and dispatch: show | check | schedule | plan | run | calibrate
    show_command.py      `fxpar show TARGET`: one rank's rewritten graph, the plan, the ledger
    check_command.py     `fxpar check TARGET`: K optimizer steps against the unmodified model
    schedule_command.py  `fxpar schedule`: build, replay and draw a pipeline schedule (no torch)
    plan_command.py      `fxpar plan` and `fxpar calibrate`: predict or search (p, t, d, b, v)
    run_command.py       `fxpar run`: a thin wrapper over torchrun
    config_flags.py      the flags of fxpar.Config's fields, generated from them (show, check, plan)
    model_shape.py       a GPT's shape (l, h, a, s, V) read from a model traced on the meta device
    calibrate.py         measuring this machine as one node of CPU "devices" over gloo
    plot.py              a replayed schedule as a Gantt chart (matplotlib)
"""
