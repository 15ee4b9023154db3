"""DJL Serving / SageMaker LMI invocations and adapter management."""
