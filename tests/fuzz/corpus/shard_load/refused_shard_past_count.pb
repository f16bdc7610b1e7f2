

mock-model 