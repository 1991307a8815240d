# State made before the bucket moved into ../modules/weights_bucket: the same objects, new addresses.
moved {
  from = aws_s3_bucket.weights
  to   = module.weights.aws_s3_bucket.this
}
moved {
  from = aws_s3_bucket_public_access_block.weights
  to   = module.weights.aws_s3_bucket_public_access_block.this
}
moved {
  from = aws_s3_bucket_versioning.weights
  to   = module.weights.aws_s3_bucket_versioning.this
}
moved {
  from = aws_s3_bucket_lifecycle_configuration.weights
  to   = module.weights.aws_s3_bucket_lifecycle_configuration.this
}
