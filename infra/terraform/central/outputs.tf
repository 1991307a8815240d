output "bucket_arn" {
  description = "ARN of the central weights bucket."
  value       = aws_s3_bucket.weights.arn
}

output "store_url" {
  description = "The --store URL of the trainers and of workers that read the central bucket."
  value       = "s3://${aws_s3_bucket.weights.id}/${trimsuffix(var.weights_prefix, "/")}"
}
