"""`compress plan`'s estimators: a recipe's memory, time, artifact sizes and device fit from the model's
config alone. planner.py builds the plan (the steps' rows, the fit, the tables); artifacts.py the model's
shape and the artifacts' sizes, each export's asked of its ExportFormat; shapes.py a model's shape without
weights and the bytes of files holding quantized records; estimates.py the throughputs and formulas the
methods' and stage kinds' plugin objects estimate with. shapes.py and estimates.py import nothing above the core,
since every method's and format's plugin object answers the plan with them."""
