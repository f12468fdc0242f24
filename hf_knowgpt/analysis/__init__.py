"""What a trained checkpoint gives: evaluation on a file of questions, scored the handouts' way
(`evaluation`, and the `evaluate` metric module in `metrics/`), and the knowledge report, calibration and
selective accuracy (`knowledge_metrics`, computed from answer scores; `knowledge_report`, the plots and
report.md)."""
