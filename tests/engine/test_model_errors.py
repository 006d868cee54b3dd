"""An error inside a unit's forward leaves a traceback whose frames hold the weights that
unit gathered; printing every frame's locals (as pytest and debuggers do) must not crash
the interpreter. Run in a child process: a crash there fails the test, not the suite."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys, tempfile
    import torch
    from torch import nn
    import offload

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x, fail):
            return self.b(torch.relu(self.a(x)), fail)

    class Layer(nn.Linear):
        def forward(self, x, fail=False):
            w = self.weight  # a view of the gathered weights, in this frame
            y = x @ w.t() + self.bias
            if fail:
                raise ValueError("bad input")
            return y

    d = tempfile.mkdtemp()
    cfg = {"engine": {"params": sys.argv[1], "grads": "host", "optimizer": "host",
                      "group_size": 5000},
           "io": {"paths": [d + "/swap"]},
           "store": {"host_budget": "64MiB", "device_budget": "64MiB", "device": "cpu"}}
    model = Fails()
    model.b = Layer(64, 64)
    engine = offload.initialize(model, cfg)
    x = torch.randn(4, 64)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            try:
                engine(x, True)
            except ValueError as e:
                tb = e.__traceback__
                shown = 0
                while tb is not None:
                    for v in list(tb.tb_frame.f_locals.values()):
                        if isinstance(v, torch.Tensor):
                            shown += len(repr(v))
                    tb = tb.tb_next
                print("shown", shown)
    engine.backward(engine(x, False).sum())  # training goes on
    engine.step()
    with torch.no_grad():
        print("ok", engine(x, False).shape)
    engine.close()
""")


def test_printing_the_traceback_of_an_error_in_forward_does_not_crash(tmp_path):
    for params in ("device", "nvme"):
        res = subprocess.run([sys.executable, "-c", CHILD, params], capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, (params, res.returncode, res.stderr[-2000:])
        assert res.stdout.count("shown") == 2 and "ok" in res.stdout, res.stdout
