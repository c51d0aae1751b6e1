"""The process reward model stage (``anyspeed posttrain --stage prm``)."""
