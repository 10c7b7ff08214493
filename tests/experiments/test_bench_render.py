"""The bench's tables and plots from hand-made rows and runs: the tables, the training curves
and their table, each variant's colour and the tick labels."""
import json
import os
from unittest import mock

import numpy as np
from absl.testing import absltest

from bench_rows import model_row, quality_row, tempdir
from experiments.bench import plots, quality, tables, targets, variants


class RenderTest(absltest.TestCase):

  def test_tables_and_plots_from_hand_rows(self):
    rng = np.random.default_rng(3)
    rows = [model_row("tower", "4096x256x8", v, s, s, rng, "towers")
            for v, s in (("bf16", 1.0), ("bf16_mods", 1.1), ("loka", 1.3))]
    rows.append({"suite": "towers", "model": "tower", "preset": "4096x256x8",
                 "variant": "pallas", "device": "H100", "error": "ValueError: boom"})
    rows += [{"suite": "quality", "data": "movielens", "model": "wukong", "preset": "tiny",
              "arm": a, "seed": s, "device": "H100", "logloss": 0.5 + 0.001 * s + d,
              "ne": 0.9, "auc": 0.75} for a, d in (("bf16", 0), ("loka", 0.0005)) for s in range(3)]
    verdicts = targets.check_all(rows)
    text = tables.report(rows, verdicts)
    self.assertIn("| tower | 4096x256x8 | LoKA | 4096 |", text)
    self.assertIn("1.30 [1.29, 1.31]", text)
    self.assertIn("error: ValueError: boom", text)
    self.assertIn("| movielens | wukong | tiny | loka | 0,1,2 | 0.50150 |", text)
    # d_s = 0.0005 / (0.5 + 0.001 s): 0.1%, 0.0998%, 0.0996%, mean +0.100%, all far above
    # +0.02%: missed.
    self.assertIn("| movielens:wukong/tiny | LoKA | bf16 | 3 | +0.100% |", text)
    self.assertIn("| missed | - |", text)
    out = tempdir(self)
    paths = plots.write_plots(rows, out)
    self.assertEqual(sorted(os.path.basename(p) for p in paths),
                     ["quality_paired.png", "speedup_towers.png"])
    for p in paths:
      with open(p, "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


  def test_training_curves_are_drawn_from_the_runs_found(self):
    # Two comparisons: DCNv2 `large` with the warm-up, whose runs are on disk (seed 2's LoKA
    # run spikes), and DLRM `small`, whose runs are not.
    rows = [quality_row("dcnv2", "large", a, s, 0.48, warmup_steps=50)
            for a in ("bf16", "bf16_mods", "loka") for s in range(3)]
    rows += [quality_row("dlrm", "small", a, 0, 0.47) for a in ("bf16", "loka")]
    empty, root = tempdir(self), tempdir(self)
    for r in rows[:9]:
      run = quality.run_dir(root, r)
      os.makedirs(run)
      spike = r["arm"] == "loka" and r["seed"] == 2
      with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step in (50, 100, 150):
          loss = 6.9 if spike and step == 100 else 0.6 - 0.0004 * step
          f.write(json.dumps({"step": step, "loss": loss, "max_loss": loss + 0.05}) + "\n")
    curve = quality.read_curve(quality.run_dir(root, rows[8]))
    self.assertEqual(curve["loss"][1], 6.9)
    self.assertEqual(curve["max_loss"][1], 6.95)
    self.assertIsNone(quality.read_curve(quality.run_dir(empty, rows[8])))
    out = tempdir(self)
    paths = plots.write_plots(rows, out, quality_runs=[empty, root])
    self.assertEqual(sorted(os.path.basename(p) for p in paths),
                     ["curves_synthetic_dcnv2_large_warmup_50.png", "quality_paired.png"])
    with open(os.path.join(out, "curves_synthetic_dcnv2_large_warmup_50.png"), "rb") as f:
      png = f.read()
    self.assertEqual(png[:8], b"\x89PNG\r\n\x1a\n")
    # Three seeds, three panels: wider than one panel's figure would be.
    self.assertGreater(int.from_bytes(png[16:20], "big"), 3 * 4.2 * 110 * 0.9)
    self.assertEqual(set(plots.ARM_COLORS), set(quality.ARMS))


  def test_half_descent_step_interpolates_between_the_logged_windows(self):
    # Straight down: half-way between 0.6 and 0.4 is the middle window itself.
    self.assertEqual(quality.half_descent_step([50, 100, 150], [0.6, 0.5, 0.4]), 100.0)
    # A plateau, then the drop: half-way (0.6) is 3/7 of the way from step 20 to step 30.
    self.assertAlmostEqual(quality.half_descent_step([0, 10, 20, 30], [1.0, 0.9, 0.9, 0.2]),
                           20 + 30 / 7)
    # A spike above the start changes nothing before the descent.
    self.assertAlmostEqual(quality.half_descent_step([0, 10, 20, 30], [1.0, 3.0, 0.9, 0.2]),
                           20 + 30 / 7)
    for flat in ([1.0, 1.0], [0.5, 0.7], [0.5], [], [float("nan"), 0.4]):
      self.assertIsNone(quality.half_descent_step(list(range(len(flat))), flat), flat)

  def test_runs_are_timed_to_one_mark_whatever_their_first_window(self):
    # Two runs leave a shared plateau (0.56) at steps 200 and 300; one started higher, which
    # moved its own half-way mark up onto the plateau and made it read early.
    steps = [50, 100, 150, 200, 250, 300, 350, 500]
    high = [0.66, 0.56, 0.56, 0.56, 0.56, 0.56, 0.49, 0.48]
    low = [0.62, 0.56, 0.56, 0.56, 0.50, 0.49, 0.485, 0.48]
    self.assertLess(quality.half_descent_step(steps, high),
                    quality.half_descent_step(steps, low))
    mark = quality.descent_mark([{"loss": high}, {"loss": low}])
    self.assertAlmostEqual(mark, 0.48 + 0.25 * (0.64 - 0.48))
    self.assertGreater(quality.descent_step(steps, high, mark),
                       quality.descent_step(steps, low, mark))
    self.assertEqual(quality.descent_step(steps, low, 0.7), 50.0)   # starts below it
    self.assertIsNone(quality.descent_step(steps, low, 0.3))        # never gets there
    self.assertIsNone(quality.descent_step([0, 1], [float("nan"), 0.4], 0.5))
    self.assertIsNone(quality.descent_mark([{"loss": [0.5, 0.6]}, {"loss": [0.5]}]))

  def test_the_curves_table_orders_runs_by_held_out_loss_beside_when_they_came_down(self):
    # Wukong `large`-like: three runs on disk, the one that leaves the plateau late holds the
    # worst held-out loss; a fourth run is not on disk and is left out.
    rows = [quality_row("wukong", "large", "bf16", 0, 0.4779, warmup_steps=50),
            quality_row("wukong", "large", "bf16_mods", 0, 0.4812, warmup_steps=50),
            quality_row("wukong", "large", "loka", 0, 0.4772, warmup_steps=50),
            quality_row("wukong", "large", "bf16", 1, 0.4807, warmup_steps=50)]
    root = tempdir(self)
    losses = {"bf16": [0.63, 0.56, 0.54, 0.48], "bf16_mods": [0.64, 0.57, 0.58, 0.48],
              "loka": [0.63, 0.53, 0.50, 0.48]}
    for r in rows[:3]:
      run = quality.run_dir(root, r)
      os.makedirs(run)
      with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for step, loss in zip((50, 100, 150, 500), losses[r["arm"]]):
          f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    table = tables.curves_table(rows, [tempdir(self), root])
    lines = table.splitlines()[2:]
    self.assertEqual([l.split(" | ")[1] for l in lines], ["loka", "bf16", "bf16_mods"])
    # One mark for all three: a quarter of their mean descent (0.6333 -> 0.48) left.
    mark = 0.48 + 0.25 * ((0.63 + 0.64 + 0.63) / 3 - 0.48)
    self.assertEqual({l.split(" | ")[5] for l in lines}, {f"{mark:.4f}"})
    steps = [float(l.split(" | ")[4]) for l in lines]
    self.assertEqual(steps, sorted(steps))
    # bf16_mods reaches the mark only past its step-150 bump, between steps 150 and 500.
    self.assertEqual(lines[2].split(" | ")[4], f"{150 + 350 * (0.58 - mark) / 0.10:.0f}")
    # loka between steps 100 (0.53) and 150 (0.50).
    self.assertEqual(lines[0].split(" | ")[4], f"{100 + 50 * (0.53 - mark) / 0.03:.0f}")
    self.assertIn("| 0.6400 (50) |", lines[2])
    self.assertIn("| 0.4800 (500) | 0.48120 |", lines[2])
    self.assertEqual(tables.curves_table(rows, [tempdir(self)]), "")
    verdicts = targets.check_all(rows)
    self.assertIn("### Training curves", tables.report(rows, verdicts, [root]))
    self.assertNotIn("### Training curves", tables.report(rows, verdicts))


class VariantColourTest(absltest.TestCase):

  def test_every_variant_has_its_own_colour(self):
    from matplotlib.colors import to_rgba
    colours = [to_rgba(plots.variant_color(v)) for v in variants.VARIANTS]
    self.assertLen(set(colours), len(variants.VARIANTS))

  def test_the_plot_draws_each_variant_in_its_colour(self):
    rows = [{"suite": "towers", "model": "tower", "preset": "4096x256x8", "variant": v,
             "device": "H100", **{m: {"speedup": 1.0 + 0.1 * i, "speedup_ci": [0.9, 2.5]}
                                   for m in ("train", "infer")}}
            for i, v in enumerate(variants.VARIANTS)]
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba
    saved = {}
    real_savefig = plt.Figure.savefig

    def keep_figure(fig, *args, **kwargs):
      saved["fig"] = fig
      return real_savefig(fig, *args, **kwargs)

    with mock.patch.object(plt.Figure, "savefig", keep_figure):
      plots.speedup_plot(rows, "towers", os.path.join(tempdir(self), "s.png"))
    handles, labels = saved["fig"].axes[0].get_legend_handles_labels()
    face = {label: to_rgba(h.patches[0].get_facecolor()) for h, label in zip(handles, labels)}
    self.assertLen(set(face.values()), len(variants.VARIANTS))
    self.assertEqual(face[variants.LABELS["loka"]], to_rgba("k"))


class TickLabelTest(absltest.TestCase):

  def test_a_long_subject_breaks_after_a_plus_or_space_and_keeps_every_character(self):
    subject = ("synthetic:dcnv2/large (warmup 50) "
               "(Mods no_bias+blocknorm+hard_swish+keep_bias:top_mlp/dense_2)")
    label = plots.tick_label(subject, width=36)
    lines = label.split("\n")
    self.assertGreater(len(lines), 1)
    self.assertEqual("".join(lines).replace(" ", ""), subject.replace(" ", ""))
    for line in lines[:-1]:
      self.assertRegex(line, r"[+)0-9]$")  # broken after a '+' or a space, never in a word
    self.assertTrue(all(len(line) <= 36 for line in lines), lines)

  def test_a_short_subject_stays_on_one_line(self):
    self.assertEqual(plots.tick_label("dlrm/large (Mods no_bias+blocknorm)", width=36),
                     "dlrm/large (Mods no_bias+blocknorm)")


if __name__ == "__main__":
  absltest.main()
