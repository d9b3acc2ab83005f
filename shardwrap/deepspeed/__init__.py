"""DeepSpeed front door: config, engine, schedules, loss scaler, optimizer, checkpoint."""
